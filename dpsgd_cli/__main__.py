from dpsgd_cli.cli import main

main()
