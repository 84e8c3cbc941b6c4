"""The triggers of deferred tasks: waiting for a key to be released, in the triggerer."""
