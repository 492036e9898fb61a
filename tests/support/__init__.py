"""What the tests share: helpers, generated runs, programs run as subprocesses."""
