# Shared by every step's test.sh.
score() { echo "$1" > /logs/verifier/reward.txt; exit 0; }
