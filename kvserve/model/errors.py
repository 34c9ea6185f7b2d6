"""Why a model cannot be loaded (raised by the config reader and the loaders)."""


class ModelConfigError(ValueError):
    """The model's files or config cannot be used; the message says why."""


class UnsupportedArchitectureError(ModelConfigError):
    """The model's architecture is not one kvserve implements."""


class ModelFilesNotFoundError(ModelConfigError):
    """The model path, its config.json or its weight files are missing."""
