"""A dry run of ``prepare`` at any world size, in one CPU process: the layout each rank would hold
(:mod:`.probe`) and ``paratrain dry-run``, its command (:mod:`.command`)."""
