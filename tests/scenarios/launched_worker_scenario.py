"""`python launched_worker_scenario.py STARTS final|crash` as torchrun's script under
bloomnative.launch.torchrun: a worker without a model that appends its rank to the file STARTS
(one line per start, so restarts are counted), then fails the way `main` fails on a bad input
(`final`: its one-line report, exit 2) or on a crash (`crash`: exit 1, once every rank of
the attempt has started)."""

from __future__ import annotations

import os
import sys
import time

starts, how = sys.argv[1:3]
with open(starts, "a") as f:
    f.write(f"{os.environ['RANK']}\n")
if how == "final":
    from bloomnative.launch.worker import final_error  # imported here: a crash needs no torch

    sys.exit(final_error("checkpoint error: checkpoint.load_step = 7: planted by the test"))
# A crash waits for every rank of this attempt to have started: torchrun stops the others as
# soon as one fails, and a rank stopped before it wrote its line would not be counted.
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
everyone = (attempt + 1) * int(os.environ["WORLD_SIZE"])
deadline = time.monotonic() + 60
while len(open(starts).read().split()) < everyone and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(1)
