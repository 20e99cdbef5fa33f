"""Apache Beam conversion jobs: raw datasets to sharded, indexed TFRecord datasets."""
