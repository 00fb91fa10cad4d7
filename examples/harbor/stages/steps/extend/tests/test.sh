#!/bin/bash
source /tests/common.sh
[ -f /srv/tool/.setup-ran ] || score 0
[ "$(/srv/tool/count.sh)" = "$WANT" ] && score 1
score 0
