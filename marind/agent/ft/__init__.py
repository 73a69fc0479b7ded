"""torchft jobs on this node (``[fault] mode = "torchft"``): one replica group per torchrun.

* ``coordinator``: the node's replica-group slot and the lighthouse election;
* ``pending``: torchft jobs waiting for a slot and a lighthouse before their torchrun starts;
* ``exits``: what the node does when its replica group ends.

What readers outside the agent need of a torchft job's keys is in ``marind.control.ft_status``.
"""
