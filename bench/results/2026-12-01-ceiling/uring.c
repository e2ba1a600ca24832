// uring: a minimal single-threaded io_uring TCP proxy, as a yardstick.
// Listens on :18080 (SO_REUSEPORT, so several processes can share it),
// connects each client to BACKEND:8080. Every receive, send, shutdown and
// close is a ring operation; one io_uring_enter submits and reaps the work of
// every connection that was ready, so system calls are batched across them.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define BUFSZ 16384
enum { OP_ACCEPT, OP_CONNECT, OP_RECV, OP_SEND, OP_SHUT, OP_CLOSE };

struct conn;
struct dir {
	struct conn *c;
	int d;          // 0: client -> backend, 1: backend -> client
	int len, off;   // bytes in buf, bytes sent
	int eof;
	char buf[BUFSZ];
};
struct conn {
	int fd[2];
	int connected;
	int refs; // outstanding operations
	int done; // directions that ended
	struct dir dir[2];
};

static struct io_uring ring;
static struct sockaddr_in bea;
static int ln;

static struct io_uring_sqe *sqe(void) {
	struct io_uring_sqe *s = io_uring_get_sqe(&ring);
	if (!s) {
		io_uring_submit(&ring);
		s = io_uring_get_sqe(&ring);
	}
	return s;
}

#define TAG(p, op) ((__u64)(uintptr_t)(p) | (op))
static void *ptr(__u64 u) { return (void *)(uintptr_t)(u & ~7ULL); }

static void post_recv(struct dir *d) {
	struct io_uring_sqe *s = sqe();
	io_uring_prep_recv(s, d->c->fd[d->d], d->buf, BUFSZ, 0);
	io_uring_sqe_set_data64(s, TAG(d, OP_RECV));
	d->c->refs++;
}

static void post_send(struct dir *d) {
	struct io_uring_sqe *s = sqe();
	io_uring_prep_send(s, d->c->fd[1 - d->d], d->buf + d->off, d->len - d->off, MSG_NOSIGNAL);
	io_uring_sqe_set_data64(s, TAG(d, OP_SEND));
	d->c->refs++;
}

static void finish(struct conn *c) {
	if (c->refs > 0) return;
	for (int i = 0; i < 2; i++) {
		struct io_uring_sqe *s = sqe();
		io_uring_prep_close(s, c->fd[i]);
		io_uring_sqe_set_data64(s, TAG(NULL, OP_CLOSE));
	}
	free(c);
}

// fail tears the connection down: shutting both sockets down makes every
// outstanding operation complete, and the last completion frees it.
static void fail(struct conn *c) {
	if (c->done == 3) return;
	c->done = 3;
	shutdown(c->fd[0], SHUT_RDWR);
	shutdown(c->fd[1], SHUT_RDWR);
}

static void post_accept(void) {
	struct io_uring_sqe *s = sqe();
	io_uring_prep_multishot_accept(s, ln, NULL, NULL, SOCK_NONBLOCK);
	io_uring_sqe_set_data64(s, TAG(NULL, OP_ACCEPT));
}

int main(int argc, char **argv) {
	signal(SIGPIPE, SIG_IGN);
	const char *be = argc > 1 ? argv[1] : "10.244.0.10";
	bea.sin_family = AF_INET;
	bea.sin_port = htons(8080);
	inet_pton(AF_INET, be, &bea.sin_addr);
	int one = 1;
	ln = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	setsockopt(ln, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	setsockopt(ln, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
	struct sockaddr_in la = {.sin_family = AF_INET, .sin_port = htons(18080)};
	if (bind(ln, (void *)&la, sizeof la) || listen(ln, 4096)) { perror("listen"); return 1; }
	struct io_uring_params p = {0};
	p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_COOP_TASKRUN;
	int err = io_uring_queue_init_params(4096, &ring, &p);
	if (err) {
		memset(&p, 0, sizeof p);
		err = io_uring_queue_init_params(4096, &ring, &p);
	}
	if (err) { fprintf(stderr, "io_uring: %s\n", strerror(-err)); return 1; }
	post_accept();
	for (;;) {
		io_uring_submit_and_wait(&ring, 1);
		struct io_uring_cqe *cqe;
		unsigned head, seen = 0;
		io_uring_for_each_cqe(&ring, head, cqe) {
			seen++;
			__u64 u = cqe->user_data;
			int op = u & 7, res = cqe->res;
			if (op == OP_CLOSE) continue;
			if (op == OP_ACCEPT) {
				if (!(cqe->flags & IORING_CQE_F_MORE)) post_accept();
				if (res < 0) continue;
				struct conn *c = calloc(1, sizeof *c);
				c->fd[0] = res;
				c->fd[1] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
				setsockopt(c->fd[0], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
				setsockopt(c->fd[1], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
				for (int i = 0; i < 2; i++) { c->dir[i].c = c; c->dir[i].d = i; }
				struct io_uring_sqe *s = sqe();
				io_uring_prep_connect(s, c->fd[1], (void *)&bea, sizeof bea);
				io_uring_sqe_set_data64(s, TAG(c, OP_CONNECT));
				c->refs++;
				continue;
			}
			if (op == OP_CONNECT) {
				struct conn *c = ptr(u);
				c->refs--;
				if (res < 0) { fail(c); finish(c); continue; }
				post_recv(&c->dir[0]);
				post_recv(&c->dir[1]);
				continue;
			}
			struct dir *d = ptr(u);
			struct conn *c = d->c;
			c->refs--;
			if (c->done == 3) { finish(c); continue; }
			switch (op) {
			case OP_RECV:
				if (res > 0) {
					d->len = res; d->off = 0;
					post_send(d);
				} else if (res == 0) {
					struct io_uring_sqe *s = sqe();
					io_uring_prep_shutdown(s, c->fd[1 - d->d], SHUT_WR);
					io_uring_sqe_set_data64(s, TAG(d, OP_SHUT));
					c->refs++;
				} else {
					fail(c);
				}
				break;
			case OP_SEND:
				if (res < 0) { fail(c); break; }
				d->off += res;
				if (d->off < d->len) post_send(d);
				else post_recv(d);
				break;
			case OP_SHUT:
				c->done |= 1 << d->d;
				break;
			}
			if (c->done == 3) finish(c);
		}
		io_uring_cq_advance(&ring, seen);
	}
}
