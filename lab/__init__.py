"""What train.py and the scripts that drive it share; nothing here has a main."""
