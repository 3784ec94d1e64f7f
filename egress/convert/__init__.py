"""Policies in other tools' languages, to and from egress policies.

    CiliumNetworkPolicy / CiliumClusterwideNetworkPolicy YAML (one or more documents)
        ─▶ cilium_read.read: each document's egress rules ─▶ an egress policy's text
           (toFQDNs → dns.allow with the rule's toPorts, rules.dns → names that may be
           asked, toCIDR/toCIDRSet → connect.allow, serverNames → check_names), or every
           construct egress cannot say exactly, refused with FILE:LINE:COL and why
    egress Policy ─▶ cilium_write.write: one CiliumNetworkPolicy's YAML (the DNS rule to
        kube-dns naming exactly the names egress answers, a toFQDNs rule per port set, a
        toCIDR rule per static destination, serverNames and HTTP host rules for checked
        ports), or refused where Cilium cannot say it (mode: audit)
    cilium_names: name and pattern translation, both ways (Cilium's ``*`` is any run of
        characters inside one label; egress's ``*.``/``**.`` are one or more whole labels)

Pure: text and policies in, text out; `egressctl import|export cilium` read and write
the files.
"""
