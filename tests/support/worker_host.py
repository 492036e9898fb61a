"""A localhost 'host' for multi-host tests: a Monarch worker loop listening on ADDRESS."""
import os, sys
os.environ.setdefault("MONARCH_FILE_LOG", "error")
from monarch.actor import run_worker_loop_forever

if __name__ == "__main__":
    run_worker_loop_forever(address=sys.argv[1], ca="trust_all_connections")
