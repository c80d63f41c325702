from aihpc.cli import main

main()
