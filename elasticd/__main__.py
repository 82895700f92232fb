"""`python -m elasticd ...` is the same as the `elasticd` console script."""

from elasticd.cli import main

main()
