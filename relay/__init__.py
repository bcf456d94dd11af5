"""kaggle-relay: quota-sized, exactly-resumable training sessions chained through the Kaggle API."""

__version__ = "0.1.0"
