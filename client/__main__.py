"""`python -m client status|draft|policy|tap ...`: the client subcommands of `codraft`."""

from client.commands import main

raise SystemExit(main())
