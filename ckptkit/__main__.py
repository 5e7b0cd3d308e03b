"""`python -m ckptkit ...` runs the command line (also under torchrun)."""
from ckptkit_cli.main import main

main()
