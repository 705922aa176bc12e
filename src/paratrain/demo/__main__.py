"""``python -m paratrain.demo``: one process of the demo job (``paratrain demo`` launches it on every process)."""

from .job import main

if __name__ == "__main__":
    main()
