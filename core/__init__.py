"""The layer below `tasks/` and `model/`: the stage contract (`stage`), the one chat template
(`chat`), the training config every trainer shares (`train_config`), the data-source resolver
(`sources`), the demo arithmetic task (`arithmetic`), small file helpers (`files`) and what the
training path needs beyond a bare GPU image (`gpu_image`). It imports nothing of ours."""
