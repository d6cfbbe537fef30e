from accelab.cli import main

main()
