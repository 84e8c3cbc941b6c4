"""The sensor that waits for a key to be free, without taking it."""
