"""CLI subcommands: every module here that defines `register(subparsers)` adds its commands."""
