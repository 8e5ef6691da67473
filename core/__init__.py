"""The layer below `tasks/` and `model/`: the stage contract (`stage`), the one chat template
(`chat`), the training config every trainer shares (`train_config`), the data-source resolver
(`sources`), the demo arithmetic task (`arithmetic`) and small file helpers (`files`). It imports
nothing of ours."""
