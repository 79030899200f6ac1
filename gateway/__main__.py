from gateway.cli.main import main

main()
