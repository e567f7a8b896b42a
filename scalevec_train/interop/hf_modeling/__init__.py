"""Source files that `python -m scalevec_train.export` copies into exported folders, for
transformers' `trust_remote_code`. They import only torch and transformers: the people who load an
export need not have scalevec. Nothing in scalevec imports them."""
