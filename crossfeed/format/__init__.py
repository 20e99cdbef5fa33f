"""The dataset format at rest: TFRecord framing and frame checks, the tf.train.Example codec, schema, manifest, index files, encoders, statistics."""
