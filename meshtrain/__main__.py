from meshtrain.cli import main

main()
