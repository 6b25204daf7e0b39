"""One module per CLI command; each registers itself on ``serl_cli.cli.app``."""
