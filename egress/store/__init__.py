"""What egress keeps on disk, and where.

    paths.py           the run dir (/run/egress, volatile), the state dir (/var/lib/egress),
                       who may read them (root and group egress: 0750, 0640), the nft
                       templates
    trust.py           the operator's policy file: refused if the workload could change it
                       (sshd's StrictModes), else read once and hashed
    claims.py          which sandbox holds which address block (a lock, a file each);
                       egressd learns other processes' changes from inotify (inotify.py)
    uids.py            the workloads' uids, taken with the claim; the host-wide ledger
    journal.py         the violation journal (SQLite, WAL, fsync per record)
    intents.py         a layer's freeze intents: the violation durable in one O_DSYNC
                       block write before the freeze, committed to the journal after it
                       (or, if the layer died, by the next Journal.open)
    journal_schema.py  its schema, migrations and file modes
    rundir.py          egressd's record per served sandbox (<run dir>/daemon/ID.json)

The journal is the evidence a person reviews: a violation is durable here (in the
layer's intent file, or committed) before any layer freezes for it (DESIGN.md
invariant 5).
"""
