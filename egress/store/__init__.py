"""What egress keeps on disk, and where.

    paths.py           the run dir (/run/egress, volatile), the state dir (/var/lib/egress),
                       the nft templates
    claims.py          which sandbox holds which address block (a lock, a file each)
    journal.py         the violation journal (SQLite, WAL, fsync per record)
    journal_schema.py  its schema, migrations and file modes
    rundir.py          egressd's record per served sandbox (<run dir>/daemon/ID.json)

The journal is the evidence a person reviews: a violation is committed here before any
layer freezes for it (DESIGN.md invariant 5).
"""
