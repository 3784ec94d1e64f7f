"""egressctl: the command-line entry point.

Each module here registers one group of subcommands on the shared argparse parser
(``register(subparsers)``) and maps the user's words onto the layers below: policy tools
call ``egress.policy`` and ``egress.datapath``; ``run`` drives ``egress.run``; the daemon
commands talk to egressd over its socket (``client.py``); ``lab`` drives ``egress.lab``.
Handlers return the process exit status; errors from the tree in ``egress.errors`` are
printed as one line each, never as a traceback.
"""
