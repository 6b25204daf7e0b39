from serl_cli.cli import main

main()
