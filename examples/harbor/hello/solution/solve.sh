#!/bin/bash
printf 'good morning\n' > /app/greeting.txt
