"""``python -m mpipar.distributed.launch``: Paddle's launcher flags on ``mpipar launch``."""

import sys

from mpipar.launch import paddle_main

if __name__ == "__main__":
    sys.exit(paddle_main(sys.argv[1:]))
