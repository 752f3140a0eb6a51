"""Exercise 2's answer: consume exactly the agreed number of leading write acks, each after its own copy."""


def writing_check(self, count):
    queue = self.controller.ack_write_queue
    for _ in range(count):  # more than this rank holds fails loudly: "pop from empty list"
        ack = queue.pop(0)
        ack.finish_event.synchronize()  # the count says the copy is done on PP rank 0, not here
        self.controller.verify(ack, "write")
        for node_id in ack.node_ids:
            node = self.ongoing_write_through.pop(node_id)
            self.dec_lock_ref(node)
            self.publish_write(node)
