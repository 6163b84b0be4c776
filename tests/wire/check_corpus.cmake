# Golden bytes: the encoder of today writes the seeds committed under fuzz/corpus, byte for byte.
# A change to the codec that changes what goes on the wire (a field renamed, reordered, encoded
# differently) fails here, before an old peer meets a new one. A deliberate format change
# regenerates the corpus (wire_gen_corpus fuzz/corpus) and commits it with the version bump.
#
#   cmake -DGEN=<wire_gen_corpus> -DCORPUS=<repo>/fuzz/corpus -DWORK=<scratch dir> -P check_corpus.cmake
#
# Files under fuzz/corpus that the generator does not write (crash reproducers, inputs found by
# fuzzing) are not compared: they are inputs, not the encoder's output.
foreach(var GEN CORPUS WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_corpus.cmake needs -D${var}=...")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK}")
execute_process(COMMAND "${GEN}" "${WORK}" RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${GEN} ${WORK} failed: ${rc}")
endif()

file(GLOB_RECURSE generated RELATIVE "${WORK}" "${WORK}/*")
list(LENGTH generated count)
if(count EQUAL 0)
  message(FATAL_ERROR "${GEN} wrote no seeds into ${WORK}")
endif()

set(mismatched "")
foreach(seed IN LISTS generated)
  if(NOT EXISTS "${CORPUS}/${seed}")
    list(APPEND mismatched "${seed} (not committed)")
    continue()
  endif()
  file(SHA256 "${WORK}/${seed}" made)
  file(SHA256 "${CORPUS}/${seed}" committed)
  if(NOT made STREQUAL committed)
    list(APPEND mismatched "${seed} (bytes differ)")
  endif()
endforeach()

if(mismatched)
  list(JOIN mismatched "\n  " lines)
  message(FATAL_ERROR "the encoder no longer writes the committed seeds:\n  ${lines}\n"
                      "If the wire format changed on purpose, regenerate fuzz/corpus.")
endif()
message(STATUS "${count} seeds byte-identical to ${CORPUS}")
file(REMOVE_RECURSE "${WORK}")
