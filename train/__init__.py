"""The training and sampling programs (`python -m train`, `python -m train.sample`)."""
