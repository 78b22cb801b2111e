"""maitre on Slurm: Slurm keeps the inventory, the processes, preemption and accounting; maitre
grows and shrinks jobs in place on what Slurm gives it.

- :mod:`.commands`: the one place that runs Slurm's commands; a failure is a
  :class:`~.commands.SlurmError` naming the command and Slurm's own message.
- :mod:`.inventory`: nodes, GPUs (GRES), features, partitions and switches, as Slurm reports them
  (``scontrol show nodes --oneliner``, ``scontrol show partition``, ``scontrol show topology``).
- :mod:`.replicas`: an elastic job's replicas as Slurm batch jobs (``sbatch --wrap "srun maitre
  agent --slurm ..."``), each one node's agent; their names say whose they are.
- :mod:`.engine`: the loop in ``maitre up --slurm`` that keeps each maitre job's replica jobs in
  line with it: its minimum in the job's partition, the surplus in the scavenger partition when
  Slurm has idle nodes there, cancelled once the coordinator has shrunk away from them.

The agent side (``maitre agent --slurm``) names the node after Slurm's and turns Slurm's
SIGTERM (preemption, ``scancel``) into a drain with the partition's ``GraceTime`` as notice.
Talks to the coordinator only over its HTTP API (:mod:`maitre.wire`), like the CLI.
"""
