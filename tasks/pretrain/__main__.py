"""`python -m gristmill.tasks.pretrain TOKENIZE_DIR OUT_DIR --config '{...}'`: the stage outside the pipeline,
once per process of a data-parallel launch (torchrun, accelerate launch; see infra/accelerate/)."""
import sys

from gristmill.tasks.pretrain.stage import main

sys.exit(main())
