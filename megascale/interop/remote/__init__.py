"""Remote code that `megascale export` copies beside a model no standard transformers architecture
computes. Only transformers imports these files (with `trust_remote_code=True`); megascale reads them as
package data."""
