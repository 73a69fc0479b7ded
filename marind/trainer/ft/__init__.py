"""torchft mode (``[fault] mode = "torchft"``): this torch world is one replica group.

* ``train``: the mode's entry (the groups' loop around ``marind.trainer.loop``);
* ``group``: one replica group's torchft Manager (lighthouse, quorum, rebuild, healing state);
* ``abort``: giving up a cross-group collective whose peer group went silent.
"""
