/* Open MPI reference for benchmarks/shm_p2p.py: windowed one-way stream bandwidth and ping-pong
 * latency between exactly two ranks. Built and run by benchmarks/mpi_reference.py.
 *
 *   mpirun -np 2 mpi_p2p --stream SIZE:ITERS:WINDOW[,...] --latency SIZE:ITERS[,...]
 *
 * stream entry:  after a barrier, rank 0 keeps WINDOW MPI_Isend in flight (cycling through WINDOW
 *                send buffers) until ITERS messages of SIZE bytes are sent; rank 1 keeps WINDOW
 *                MPI_Irecv posted (cycling through WINDOW receive buffers, re-posting each as it
 *                completes), then sends a one-byte ack. Timed on rank 0 from the barrier until the
 *                ack arrived; preceded by one untimed pass of max(2, ITERS/8) messages.
 * latency entry: MPI_Send/MPI_Recv ping-pong of SIZE bytes, max(10, ITERS/10) untimed round trips,
 *                then ITERS timed ones; one-way latency = elapsed / (2 * ITERS).
 *
 * Rank 0 prints one line of JSON on stdout:
 *   {"stream": [{"size", "iters", "window", "seconds_per_message"}...],
 *    "latency": [{"size", "iters", "one_way_seconds"}...], "mpi_version": "..."}
 * Errors go to stderr and the exit status is nonzero.
 */
#include <mpi.h>

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TAG_DATA 1
#define TAG_ACK 2
#define TAG_PING 3
#define MAX_ENTRIES 64
#define MAX_WINDOW 4096

typedef struct {
    long size, iters, window;
    double seconds_per_message;
} stream_entry;

typedef struct {
    long size, iters;
    double one_way_seconds;
} latency_entry;

static int rank;

/* Any MPI error: say where on stderr and take the whole job down with a nonzero status. */
#define CHECK(call)                                                                   \
    do {                                                                              \
        int rc_ = (call);                                                             \
        if (rc_ != MPI_SUCCESS) {                                                     \
            char msg_[MPI_MAX_ERROR_STRING];                                          \
            int len_ = 0;                                                             \
            MPI_Error_string(rc_, msg_, &len_);                                       \
            fprintf(stderr, "mpi_p2p: rank %d: %s failed: %s\n", rank, #call, msg_);  \
            MPI_Abort(MPI_COMM_WORLD, 3);                                             \
        }                                                                             \
    } while (0)

static void usage(FILE *out) {
    fprintf(out,
            "usage: mpirun -np 2 mpi_p2p [--stream SIZE:ITERS:WINDOW[,...]] [--latency SIZE:ITERS[,...]]\n"
            "  --stream   one-way windowed stream: SIZE bytes per message, ITERS messages, WINDOW in flight\n"
            "  --latency  ping-pong: SIZE bytes, ITERS timed round trips\n"
            "At least one entry is required. Rank 0 prints one line of JSON on stdout.\n");
}

static int parse_long(const char *text, long min, long max, long *out) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || end == text || *end != '\0' || value < min || value > max) return -1;
    *out = value;
    return 0;
}

/* Parses "a:b[:c],a:b[:c],..." with `fields` numbers per entry into `values` (row-major); returns
 * the entry count or -1 with a message in `err`. */
static int parse_spec(const char *spec, int fields, long values[][3], char *err, size_t errlen) {
    char *copy = strdup(spec), *save_entry = NULL;
    int count = 0;
    if (!copy) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (char *entry = strtok_r(copy, ",", &save_entry); entry; entry = strtok_r(NULL, ",", &save_entry)) {
        if (count == MAX_ENTRIES) {
            snprintf(err, errlen, "more than %d entries", MAX_ENTRIES);
            goto fail;
        }
        char *save_field = NULL, *field = strtok_r(entry, ":", &save_field);
        int n = 0;
        for (; field; field = strtok_r(NULL, ":", &save_field), n++) {
            /* size: 1 B .. INT_MAX (an MPI count of MPI_BYTE); iters and window: at least 1 */
            long max = n == 0 ? INT_MAX : (n == 2 ? MAX_WINDOW : INT_MAX);
            if (n >= fields || parse_long(field, 1, max, &values[count][n]) != 0) {
                snprintf(err, errlen, "bad entry '%s' (field %d: want %s with positive integers%s)", spec,
                         n + 1, fields == 3 ? "SIZE:ITERS:WINDOW" : "SIZE:ITERS",
                         fields == 3 ? ", WINDOW <= 4096, SIZE < 2 GiB" : ", SIZE < 2 GiB");
                goto fail;
            }
        }
        if (n != fields) {
            snprintf(err, errlen, "bad entry in '%s': want %s", spec, fields == 3 ? "SIZE:ITERS:WINDOW" : "SIZE:ITERS");
            goto fail;
        }
        count++;
    }
    free(copy);
    if (count == 0) snprintf(err, errlen, "empty list '%s'", spec);
    return count ? count : -1;
fail:
    free(copy);
    return -1;
}

static char *alloc_touched(size_t size, unsigned char fill) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, size ? size : 1) != 0) {
        fprintf(stderr, "mpi_p2p: rank %d: cannot allocate %zu bytes\n", rank, size);
        MPI_Abort(MPI_COMM_WORLD, 4);
    }
    memset(p, fill, size); /* fault every page in before anything is timed */
    return p;
}

/* One pass of the stream; returns seconds on rank 0 (0 on rank 1). */
static double stream_pass(char **buffers, long size, long iters, long window, MPI_Request *reqs) {
    char ack = 0;
    CHECK(MPI_Barrier(MPI_COMM_WORLD));
    double started = MPI_Wtime();
    if (rank == 0) {
        for (long i = 0; i < iters; i++) {
            long slot = i % window;
            if (i >= window) CHECK(MPI_Wait(&reqs[slot], MPI_STATUS_IGNORE)); /* the oldest in flight */
            CHECK(MPI_Isend(buffers[slot], (int)size, MPI_BYTE, 1, TAG_DATA, MPI_COMM_WORLD, &reqs[slot]));
        }
        CHECK(MPI_Waitall((int)(iters < window ? iters : window), reqs, MPI_STATUSES_IGNORE));
        CHECK(MPI_Recv(&ack, 1, MPI_CHAR, 1, TAG_ACK, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        return MPI_Wtime() - started;
    }
    long posted = 0;
    for (; posted < window && posted < iters; posted++)
        CHECK(MPI_Irecv(buffers[posted], (int)size, MPI_BYTE, 0, TAG_DATA, MPI_COMM_WORLD, &reqs[posted]));
    for (long i = 0; i < iters; i++) {
        long slot = i % window;
        CHECK(MPI_Wait(&reqs[slot], MPI_STATUS_IGNORE));
        if (posted < iters) { /* posted % window == slot: the buffer just filled is reused */
            CHECK(MPI_Irecv(buffers[slot], (int)size, MPI_BYTE, 0, TAG_DATA, MPI_COMM_WORLD, &reqs[slot]));
            posted++;
        }
    }
    CHECK(MPI_Send(&ack, 1, MPI_CHAR, 0, TAG_ACK, MPI_COMM_WORLD));
    return 0.0;
}

static double run_stream(long size, long iters, long window) {
    char **buffers = malloc(sizeof(char *) * window);
    MPI_Request *reqs = malloc(sizeof(MPI_Request) * window);
    if (!buffers || !reqs) {
        fprintf(stderr, "mpi_p2p: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 4);
    }
    for (long i = 0; i < window; i++) buffers[i] = alloc_touched((size_t)size, rank == 0 ? 1 : 0);
    long warm = iters / 8 > 2 ? iters / 8 : 2;
    stream_pass(buffers, size, warm, window, reqs);
    double seconds = stream_pass(buffers, size, iters, window, reqs);
    for (long i = 0; i < window; i++) free(buffers[i]);
    free(buffers);
    free(reqs);
    return seconds / (double)iters;
}

static double run_latency(long size, long iters) {
    char *out = alloc_touched((size_t)size, 1), *back = alloc_touched((size_t)size, 0);
    int peer = 1 - rank;
    double elapsed = 0.0;
    CHECK(MPI_Barrier(MPI_COMM_WORLD));
    for (int timed = 0; timed < 2; timed++) {
        long count = timed ? iters : (iters / 10 > 10 ? iters / 10 : 10);
        double started = MPI_Wtime();
        for (long i = 0; i < count; i++) {
            if (rank == 0) {
                CHECK(MPI_Send(out, (int)size, MPI_BYTE, peer, TAG_PING, MPI_COMM_WORLD));
                CHECK(MPI_Recv(back, (int)size, MPI_BYTE, peer, TAG_PING, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
            } else {
                CHECK(MPI_Recv(back, (int)size, MPI_BYTE, peer, TAG_PING, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
                CHECK(MPI_Send(out, (int)size, MPI_BYTE, peer, TAG_PING, MPI_COMM_WORLD));
            }
        }
        elapsed = MPI_Wtime() - started;
    }
    free(out);
    free(back);
    return elapsed / (2.0 * (double)iters);
}

/* The first line of `text` as a JSON string body (quotes, backslashes and control bytes escaped). */
static void print_json_line(const char *text) {
    for (const unsigned char *p = (const unsigned char *)text; *p && *p != '\n'; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
}

int main(int argc, char **argv) {
    static long stream_spec[MAX_ENTRIES][3], latency_spec[MAX_ENTRIES][3];
    static stream_entry streams[MAX_ENTRIES];
    static latency_entry latencies[MAX_ENTRIES];
    int n_stream = 0, n_latency = 0, size = 0, bad = 0;
    char err[512] = "";

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);

    /* Every rank parses the same argv, so all of them agree on whether to go on. */
    for (int i = 1; i < argc && !bad; i++) {
        int is_stream = strcmp(argv[i], "--stream") == 0, is_latency = strcmp(argv[i], "--latency") == 0;
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            if (rank == 0) usage(stdout);
            MPI_Finalize();
            return 0;
        } else if ((is_stream || is_latency) && i + 1 < argc) {
            int n = is_stream ? parse_spec(argv[++i], 3, stream_spec, err, sizeof err)
                              : parse_spec(argv[++i], 2, latency_spec, err, sizeof err);
            if (n < 0) bad = 1;
            else if (is_stream) n_stream = n;
            else n_latency = n;
        } else {
            snprintf(err, sizeof err, "unexpected argument '%s'%s", argv[i],
                     is_stream || is_latency ? " (needs a value)" : "");
            bad = 1;
        }
    }
    if (!bad && n_stream + n_latency == 0) {
        snprintf(err, sizeof err, "nothing to measure: give --stream and/or --latency");
        bad = 1;
    }
    if (!bad && size != 2) {
        snprintf(err, sizeof err, "needs exactly 2 ranks, got %d (mpirun -np 2)", size);
        bad = 1;
    }
    if (bad) {
        if (rank == 0) {
            fprintf(stderr, "mpi_p2p: %s\n", err);
            usage(stderr);
        }
        MPI_Finalize();
        return 2;
    }

    for (int i = 0; i < n_stream; i++) {
        streams[i].size = stream_spec[i][0];
        streams[i].iters = stream_spec[i][1];
        streams[i].window = stream_spec[i][2];
        streams[i].seconds_per_message = run_stream(streams[i].size, streams[i].iters, streams[i].window);
    }
    for (int i = 0; i < n_latency; i++) {
        latencies[i].size = latency_spec[i][0];
        latencies[i].iters = latency_spec[i][1];
        latencies[i].one_way_seconds = run_latency(latencies[i].size, latencies[i].iters);
    }

    if (rank == 0) {
        char version[MPI_MAX_LIBRARY_VERSION_STRING];
        int len = 0;
        MPI_Get_library_version(version, &len);
        printf("{\"stream\": [");
        for (int i = 0; i < n_stream; i++)
            printf("%s{\"size\": %ld, \"iters\": %ld, \"window\": %ld, \"seconds_per_message\": %.6e}",
                   i ? ", " : "", streams[i].size, streams[i].iters, streams[i].window,
                   streams[i].seconds_per_message);
        printf("], \"latency\": [");
        for (int i = 0; i < n_latency; i++)
            printf("%s{\"size\": %ld, \"iters\": %ld, \"one_way_seconds\": %.6e}", i ? ", " : "",
                   latencies[i].size, latencies[i].iters, latencies[i].one_way_seconds);
        printf("], \"mpi_version\": \"");
        print_json_line(version);
        printf("\"}\n");
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
