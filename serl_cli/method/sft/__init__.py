"""SFT data that teaches a small model to read a hindsight block (``train.hindsight_sft``):
:mod:`~serl_cli.method.sft.hindsight`, :mod:`~serl_cli.method.sft.reading`."""
