from kvgate.cli import main

main()
