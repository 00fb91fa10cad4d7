"""The persistent shell every runtime runs its commands in: the bash, its channel, its text, its spawn."""
