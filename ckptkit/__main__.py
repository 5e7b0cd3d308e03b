"""`python -m ckptkit ...` runs the command line (also under torchrun)."""

from ckptkit_cli.entry import main

main()
