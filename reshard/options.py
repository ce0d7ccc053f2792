"""The defaults and help texts the reshard tools and their command line share, each once.

Imports nothing: the command line builds its parser from these, and ``reshard --help`` never
imports torch. The tools' modules take their defaults from here.
"""

DEFAULT_BUDGET = 1 << 30  # convert, export-hf, import-hf: tensor bytes a streaming run holds at once
DEFAULT_MEMORY_BUDGET = 1 << 30  # import-dcp, import-deepspeed: decoded tensor bytes held at once
DEFAULT_MAX_SHARD_SIZE = "5GB"  # export-hf: the largest output file (Hugging Face's own default)
DEFAULT_MODEL_PREFIX = "model."  # import-deepspeed: the prefix of parameter and buffer names

DCP_TRUST_PICKLE_HELP = (
    "DCP's .metadata is a Python pickle, and loading a pickle can run code. shardfmt reads it "
    "with a restricted unpickler that admits only DCP's metadata classes, torch.Size, torch "
    "dtypes and plain containers (anything else is refused), and reads tensors with "
    "torch.load(weights_only=True); still, import only checkpoints whose origin you trust, and "
    "say so with trust_pickle=True (CLI: --trust-pickle).")

DEEPSPEED_TRUST_PICKLE_HELP = (
    "DeepSpeed's *_model_states.pt and *_optim_states.pt files are torch.save pickles, and loading a "
    "pickle can run code. shardfmt reads them with a restricted unpickler that admits only torch's "
    "tensor rebuilders and storages, torch.Size, dtypes, plain containers and DeepSpeed's "
    "ZeroStageEnum, LossScaler and fragment_address as inert stand-ins (anything else is refused); "
    "still, import only checkpoints whose origin you trust, and say so with trust_pickle=True "
    "(CLI: --trust-pickle).")
