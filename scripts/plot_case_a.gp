# P's KV usage over time in case A (D killed at t=23 s): 480 s timeout against a 30 s lease.
# Input: out/scenario_a_timeline.csv (written by `kvferry sim --scenario A --csv out`).
set datafile separator ","
set terminal pngcairo size 1000,500 noenhanced
set output "out/case_a.png"
set title "Case A: P's KV usage after D is killed at t=23 s (simulated, full scale)"
set xlabel "time (s)"
set ylabel "P KV blocks in use (%)"
set yrange [0:105]
set key center right
set grid
set arrow from 23, graph 0 to 23, graph 1 nohead dashtype 2
set label "D killed" at 25, 101
plot "out/scenario_a_timeline.csv" using 1:2 with lines linewidth 2 title "480 s timeout (no lease)", \
     "" using 1:3 with lines linewidth 2 title "30 s lease"
