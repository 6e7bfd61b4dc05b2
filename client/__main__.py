"""`python -m codraft.client status|draft|policy|tap ...`: the client subcommands of `codraft`."""

from codraft.client.commands import main

raise SystemExit(main())
