"""Model-building tools kept out of the engine and studio libraries (training, evaluation)."""
