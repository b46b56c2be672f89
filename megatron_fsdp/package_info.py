"""Package metadata, under the names upstream megatron-fsdp exports (its ``__all__`` lists them);
the version is pyproject.toml's."""

__version__ = "0.1.0"
__shortversion__ = "0.1.0"
__package_name__ = "megatron_fsdp"
__description__ = "Fully sharded data parallelism (ZeRO-1/2/3, HSDP) for PyTorch on flat per-unit buffers"
# Not declared by this project yet (no license file, no URLs in pyproject.toml): empty, not invented.
__license__ = ""
__keywords__ = "deep learning, distributed training, fully sharded data parallel, FSDP, ZeRO, pytorch"
__contact_names__ = "megatron_fsdp maintainers"
__contact_emails__ = ""
__homepage__ = ""
__repository_url__ = ""
__download_url__ = ""
