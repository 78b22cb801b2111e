"""The cluster engines people already run, and what maitre asks of them (:mod:`.slurm`)."""
