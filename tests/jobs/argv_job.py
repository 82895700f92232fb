"""A decorated script that parses its own arguments at the top, as `python argv_job.py ARGS` gives them.

    elasticd run argv_job.py --lr 0.5 --out PREFIX     # N from the decorator; rank r writes PREFIX{r}.json

Every execution of the top level appends its pid to PREFIX.tops, so a test can count who ran it.
"""

import argparse
import json
import os
import sys

import elasticd

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, required=True)
parser.add_argument("--out", required=True)
ARGS = parser.parse_args()
with open(f"{ARGS.out}.tops", "a") as f:
    f.write(f"{os.getpid()}\n")


@elasticd.elastic(workers=2)
def train(ctx) -> None:
    with open(f"{ARGS.out}{ctx.rank}.json", "w") as f:
        json.dump({"argv": sys.argv[1:], "lr": ARGS.lr, "world": ctx.world_size}, f)


if __name__ == "__main__":
    train()
