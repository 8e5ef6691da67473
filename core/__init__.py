"""The layer below `tasks/` and `model/`: the stage contract (`stage`), the one chat template
(`chat`), the training settings every trainer shares (`settings`), the data-source resolver
(`sources`), the demo arithmetic task (`arithmetic`) and small file helpers (`files`). It imports
nothing of ours."""
