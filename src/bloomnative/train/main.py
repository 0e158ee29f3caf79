"""`python -m bloomnative.train.main`: the worker entry's former name, kept for command lines
written before it moved; the entry is `bloomnative.launch.worker`."""

from bloomnative.launch.worker import main
from bloomnative.train.distributed import exit_process

if __name__ == "__main__":
    exit_process(main())
