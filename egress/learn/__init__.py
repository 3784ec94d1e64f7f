"""Learning a policy from what audit runs saw (``egressctl learn``).

    journal audit rows (store.audit_sql) ─▶ observed.collect: one entry per name, per
        destination, over every sandbox chosen
    ─▶ risks.classify: tunnel-shaped names, rebinding answers, data-only types, names
        that are no hostname: set aside, never allowed
    ─▶ siblings.group: ``*.``/``**.`` only for at least N siblings under one registered
        domain (Public Suffix List), never over a public suffix
    ─▶ draft.Draft (rules with their evidence, static destinations, risks)
    ─▶ write.policy_text: a policy with a comment on every entry; validated before use
    ─▶ diff.against: what learning would add to and remove from an existing policy

Pure: rows and ``now`` in, text out. The CLI reads the journal and writes the file.
"""
