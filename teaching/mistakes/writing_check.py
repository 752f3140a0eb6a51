"""Wrong answers to exercise 2 (`writing_check`); see pp_sync.py beside this file."""


def only_finished_here(self, count):
    """Consumes the agreed count, but only the acks whose copy has finished on this rank."""
    queue = self.controller.ack_write_queue
    ready = 0
    while ready < min(count, len(queue)) and queue[ready].finish_event.query():
        ready += 1
    for _ in range(ready):
        ack = queue.pop(0)
        for node_id in ack.node_ids:
            node = self.ongoing_write_through.pop(node_id)
            self.dec_lock_ref(node)
            self.publish_write(node)


def no_wait(self, count):
    """Consumes the agreed count without waiting for this rank's own copy."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        ack = queue.pop(0)
        self.controller.verify(ack, "write")
        for node_id in ack.node_ids:
            node = self.ongoing_write_through.pop(node_id)
            self.dec_lock_ref(node)
            self.publish_write(node)


def newest_first(self, count):
    """Takes the acks from the back of the queue."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        ack = queue.pop()
        ack.finish_event.synchronize()
        for node_id in ack.node_ids:
            node = self.ongoing_write_through.pop(node_id)
            self.dec_lock_ref(node)
            self.publish_write(node)


def keeps_the_lock(self, count):
    """Forgets to release the write-through's lock."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        ack = queue.pop(0)
        ack.finish_event.synchronize()
        for node_id in ack.node_ids:
            self.publish_write(self.ongoing_write_through.pop(node_id))


def releases_twice(self, count):
    """Releases the lock once per node and once more per ack."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        ack = queue.pop(0)
        ack.finish_event.synchronize()
        for node_id in ack.node_ids:
            node = self.ongoing_write_through.pop(node_id)
            self.dec_lock_ref(node)
            self.publish_write(node)
        self.dec_lock_ref(node)


def forgets_to_publish(self, count):
    """Unlocks the nodes but never publishes them (no backup to storage)."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        ack = queue.pop(0)
        ack.finish_event.synchronize()
        for node_id in ack.node_ids:
            self.dec_lock_ref(self.ongoing_write_through.pop(node_id))


def leaves_them_in_flight(self, count):
    """Reads the nodes from ongoing_write_through without taking them out."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        ack = queue.pop(0)
        ack.finish_event.synchronize()
        for node_id in ack.node_ids:
            node = self.ongoing_write_through[node_id]
            self.dec_lock_ref(node)
            self.publish_write(node)


def unlocks_every_write(self, count):
    """Consumes the agreed acks, then releases every write in flight, not only theirs."""
    queue = self.controller.ack_write_queue
    for _ in range(count):
        queue.pop(0).finish_event.synchronize()
    for node_id in list(self.ongoing_write_through):
        node = self.ongoing_write_through.pop(node_id)
        self.dec_lock_ref(node)
        self.publish_write(node)


def calls_the_labs_own(self, count):
    """The lab's own consumption of acks called from the student's function."""
    for node in self._consume_acks(self.controller.ack_write_queue, "write", self.ongoing_write_through, count):
        self.publish_write(node)
